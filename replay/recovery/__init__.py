"""recover: true probabilities for recorded transcripts. One-way flow:
prompt ids (prompt.py) and KV reuse (prefix.py) -> evaluation with the server's decode schedule
(evaluate.py) -> comparison, pure (compare.py) -> repaired copies (repair.py) -> report (report.py);
recover.py runs it and is the API (`recover`, `recover_records`, `Recoverer`)."""
