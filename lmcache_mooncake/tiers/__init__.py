"""Storage tiers plugged into LMCache."""
