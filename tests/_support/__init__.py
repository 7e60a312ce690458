"""Test doubles and helpers that several test folders share (one copy each)."""
