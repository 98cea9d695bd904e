"""`tune`'s own parts, between the loop's results and the report (docs/tune.md):

    sweep.py      the settings of a sweep, spelled as llama-server spells its flags       (pure)
    runs.py       what one record did under one setting, and a setting over the file    (data)
    stats.py      intervals over sampled runs                                           (pure)
    costs.py      a cost table and the speed it predicts for some work                  (pure)
    measure.py    the cost table measured on this host with the user's models           (libllama)
    calibrate.py  the cost table from the transcript's own timings                      (pure)
"""
