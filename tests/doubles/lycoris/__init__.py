"""Double of the LyCORIS package (only its sd-scripts entry point, ``lycoris.kohya``)."""
