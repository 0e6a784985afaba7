"""What the head methods (medusa/, eagle/) share: the draft vocabulary."""
