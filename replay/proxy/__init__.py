"""`spec-replay proxy`: real probabilities, live, in front of an unpatched speculating llama-server.

    exchange.py   one request through the proxy as data: what it asks upstream, what the client gets (pure)
"""
