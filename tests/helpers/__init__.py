"""Helpers more than one test module uses (a test module never imports another's)."""
