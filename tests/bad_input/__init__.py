"""The rows of tests/test_bad_input.py: the harness (table.py) and the rows by layer."""
