"""What people read about a run, a sweep or a collectives benchmark: HTML, PNG plots and text tables,
made from the files the runs leave (never from a live process)."""
