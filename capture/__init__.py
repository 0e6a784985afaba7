"""Capture: what the frozen target computes, kept for the heads and drafts trained on it.

    layers.py   the layer convention (layer i = OUTPUT of decoder layer i, pre-norm) and EAGLE-3's layer ids
    forward.py  one forward pass returning chosen layers, the post-norm last hidden state and top-k logits
    cache.py    the capture cache on disk: sharded safetensors keyed by row_id, resumable
    offline.py  teacher-forced capture of finished rows into the cache (`draftsmith data capture`)
    online.py   `CaptureSource`: a training job's features per batch, online (the target in the step) or
                offline (from the cache), as the same tensors
    config.py   `CaptureConfig`, the `capture` section of a data preset

It sits right after targets/ (scripts/check_imports.py): it needs a target and nothing else, and the
decoder's verifier, the data engine (capture while it generates) and training all read it.
"""
