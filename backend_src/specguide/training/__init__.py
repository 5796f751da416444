"""Offline training (the draft head) and its prompt sets. Serving never imports this package."""
