"""Test double of sd-scripts' ``library`` package (see tests/doubles/README.md)."""
