"""The one runner: `run(method, cfg)` trains any registered method's job through the one loop (training/)
and evaluates what it wrote (evaluation/), and `draftsmith train METHOD` is its command. It sits above
evaluation, which a method's job never reaches: a method folder only declares its `Job`."""
