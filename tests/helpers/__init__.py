"""Helpers shared by several test modules; no test module imports another test module."""
