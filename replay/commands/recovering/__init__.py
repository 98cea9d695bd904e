"""recover's per-record pipeline, one stage a module (commands/recover.py Recoverer drives them):

    options.py    RecoverOptions: how recover evaluates, besides the server's settings
    schedule.py   which schedule computes a record: the one-token schedule, or the server's loop
    one_token.py  the one-token schedule on one slot kept from record to record; the server's -t from values
    outcomes.py   each true value paired with the server's entry it owns, compared
    assembly.py   the record's report, and what the next record keeps of its KV

The judgement of the values between comparison and report (exact or approximate, within what, why) is
comparison/judgement.py, with its bounds in comparison/bounds.py.
"""
