"""The front door: how every run of recover, diff, trace and tune starts, for the command line, the
Python API (replay.recover, replay.trace, replay.tune) and the worker processes alike.

    inputs.py     Inputs (the transcript, its request, the target: read and checked once, one line each)
                  and Outputs (never an input, never overwritten without --force)
    engine.py     choose_engine: the libllama and its CPU kernels (runtime/engine.py EngineChoice), chosen
                  once with what the choice says, before any model loads
    kernels/      which CPU kernels computed a transcript: the probes' types, the pure choice and the
                  kernel classes, the probe cache, the probe processes, and the policy over them
    task.py       a run's task and session: the one loop over a run's items, in one process or many
    recover.py    recover and diff: RecoverTask, `recover` (the API)
    trace.py      trace: TraceTask, `trace` (the API)
    tune.py       tune: TuneTask, `tune` (the API)

A run: inputs -> engine -> task.open(inputs, engine) (the engine applied, the models loaded once) ->
session.run(unit) for every unit, here or on workers (scale/) -> the commands' results.
"""
