"""Host adapters: the only code that knows a host trainer's names (sd-scripts, the lab trainer)."""
