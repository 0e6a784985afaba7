"""Every engine that produces text, behind one interface (base.py)."""
