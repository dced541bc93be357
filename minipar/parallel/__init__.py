"""One module (or small folder) per parallel training paradigm; see DESIGN.md for the list."""
