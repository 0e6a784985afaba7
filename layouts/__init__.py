"""What every method's export layouts are written and checked with, naming no method.

    schema.py   what every reader of an artifact or export file is built of: a JSON file read or refused in one
                line, a field checked for type and range, the draft vocabulary's maps (d2t, t2d) checked
    inspect.py  an artifact read the way every consumer reads it (`draftsmith check`, import-export)
    common.py   the stacks, the export's result record, its guard (draftsmith.json) and its reader, serve.md
    card.py     the model card (README.md) an export folder uploads with
    verify.py   a written layout read back by its safetensors headers, and the verifiers' registry
    heads.py    the writer every head layout shares (`HeadExport`, `export_heads`)
    serving.py  each stack's launch command, and `Serving`: what export/ asks a method about serving it

Each method folder's export.py writes its layouts with these; export/ (the drivers: `export_artifact`,
`draftsmith serve-check`) sits above the methods and reaches them through the registry. Nothing here needs
more than an artifact and a target, so training reads a checkpoint's safetensors headers with verify.py too.
"""
