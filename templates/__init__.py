"""Jinja templates of every rendered artifact (package data)."""
