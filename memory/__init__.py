"""How much memory a target, an artifact or a training job needs per GPU, counted from configs on the `meta`
device: serving (`serving.py`: weights, KV cache, activations, the largest batch that fits) and training
(`training.py`: the frozen target, the trained module, its optimizer, one micro-batch). Each method folder's
`memory.py` writes its estimate with these counting rules, so they sit below the method folders;
`draftsmith plan` (planning/) drives them for any method."""
