"""Every benchmark in one folder: `draftsmith bench` (run.py: data, training and evaluation of every artifact in
one run, the numbers BENCHMARKS.md publishes, kept in the checkout's results/), the headline comparison
(headline.py), llama.cpp as an outside reference (llamacpp.py), and the timing modules of single stages:
the decode engines (engine.py), teacher-forced capture against generation with capture (capture.py), the
embedded engine against an OpenAI-compatible server (remote.py) and one EAGLE training step (eagle_step.py)."""
