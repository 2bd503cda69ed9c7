"""The pieces of ``specula bench report`` (``runtime/bench/report/run.py`` runs them in order and writes the report).

    machine.py   machine facts (cores, CPU model, torch threads, versions) and the short slug of the output folder
    drafters.py  which drafters this checkout can run (chain and tree), and why the others are missing
    measure.py   the round-robin timing loop over engines and its summary (tau, alpha_n, speedup, time split)
    sections.py  one function per report section; a section that fails records its reason instead
    claims.py    one rule per seed paper's claim, evaluated over the report's JSON
    reliability.py  the reliability suite by pytest in a child process, and the figures its tests record
    render.py    markdown and PNG plots from the JSON
"""
