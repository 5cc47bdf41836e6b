"""Example accounting HTTP service."""
