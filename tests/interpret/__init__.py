"""Scripts run under ``TRITON_INTERPRET=1`` in a subprocess (the switch must precede ``import triton``)."""
