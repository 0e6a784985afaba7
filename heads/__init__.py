"""What the methods share, so that no method folder imports another: reduced draft vocabularies
(vocab.py), LoRA adapters (lora.py) and the knowledge-distillation losses (losses.py)."""
