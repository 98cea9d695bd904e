"""`spec-replay proxy`: real probabilities, live, in front of an unpatched speculating llama-server.

    exchange.py   one request through the proxy as data: what it asks upstream, what the client gets (pure)
    filler.py     the values of a proxied response, recovered as `recover` recovers them
    app.py        the HTTP side (aiohttp): forward, fill, stream, pass through, refuse in one line
"""
