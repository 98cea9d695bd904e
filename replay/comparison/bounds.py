"""The measured bounds recover and trace hold values to, each with what it was measured on, in one place.

A value is exact when the replay computed it as the server did (comparison/values.py compare, at
DEFAULT_TOLERANCE). Where something the replay does not reproduce moved the server's values, these say by
how much at most, as measured; the rules that apply them are comparison/judgement.py (recover's values)
and comparison/divergence.py (trace's explanation of a divergence). Two of them bound the same thing,
what batches shared with other requests move a single value by, measured twice over different records
and ranges: SHARED_ENTRY_DRIFT (recover: a record's single later entry) and MULTI_SLOT_NOISE (trace: a
value up to a divergence); each names its own measurement.
"""
from __future__ import annotations

# Where recover cannot compute a speculating server's values in the decodes that computed them, they
# are approximate from the first such token on, real entries there are judged within this bound, and
# the report says so (schedule.approximate_from, a note). Two cases: a target whose memory cannot drop a
# suffix (Gemma 3's sliding window, recurrent and hybrid models) verifies a partly accepted draft by
# restoring a checkpoint and decoding the accepted tokens again (server-context.cpp:4276-4305), in
# batches the transcript does not show, which past 256 positions change values (schedule/rows.py):
# measured up to 0.29 nats on a low-probability alternative of Gemma 3 270M with its draft
# (tests/test_gemma.py); and with flash attention off, a verify batch's attention runs through matmul
# kernels that take another path for several rows than for one, so no one-row decode gives its rows:
# measured 0.027 nats on a later real entry of SmolLM2 Q4_1 (tests/test_numerics_flags.py). Until
# recover replays the verify batches themselves (trace does), these are approximate.
APPROXIMATE_DRIFT = 0.3
# A server with several slots decodes a request in batches shared with other requests, which changes
# the CPU kernels and the KV layout: its real values then differ from a one-request evaluation.
# Measured on SmolLM2 Q4_1 (b11434, -np auto = 4 slots, 4 concurrent requests at a time, 36
# records of plain, draft-simple and ngram-mod servers), as the probability-weighted mean |diff|
# of an entry's token and alternatives (weighted_disagreement):
#     the first entry (computed in the prompt batch):  at most 0.149 nats; with the Q2_K
#                                                       requantisation as the model, 0.455 or more
#     the whole record:                                at most 0.158; with Q2_K, 0.122 or more
# Later entries of a plain server, decoded in batches shared with other slots, reached 0.457 on
# their own, so the first entry tells a wrong model file from batching; the record mean is a
# sanity bound. Beyond the bound the model file or the build is not the server's.
BATCH_BOUND = 0.25
# The largest single later entry of those measurements (a plain 4-slot server): what a record with
# evidence of shared batches says its values may be off by, even where its own real entries agree.
SHARED_ENTRY_DRIFT = 0.46
# Measured again with a 4-slot b11434 server and 8 concurrent OpenAI-SDK chat requests (bench/identity.py,
# docs/recover.md "A wrong model file"): the right model's first entries were 0 to 0.152 nats off
# (SmolLM2 Q4_1) and 0.012 to 0.141 (Gemma 3 Q4_K_M); requantised to Q4_0 they were 0.17 to 1.03 and
# 0.92 to 1.15 (records 0.38 or more), to Q2_K 0.36 or more. A Q8_0 requantisation stays within the
# noise (first entries 0.01 to 0.15): values cannot tell it, the transcript's model name does
# (reading/identity.py). A model every record's first entry is this far from is not the server's,
# whatever else may have moved the values.
FIRST_ENTRY_BOUND = 0.2
# The words of settings/config.py idle_cells_kept's evidence: other slots' cells in a unified cache (same
# judgement as shared batches, a weaker form of the same cause: other sequences' cells in the KV view).
KEPT_CELLS = "keeps idle slots' cells"

# nats, the numeric difference trace assumes at a divergence when the transcript has no real values to
# measure it on (the largest seen: 0.093)
DEFAULT_NOISE = 0.1
# nats, at a placeholder on a multi-slot server: the largest |server - one-request| difference on a real
# value of 4 concurrent requests to a 4-slot b11434 server (SmolLM2 Q4_1, 12 records, all values up to
# each record's first divergence: 0.416)
MULTI_SLOT_NOISE = 0.42
