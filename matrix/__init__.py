"""Engine x transport x store combinations: runner, load generator, reports."""
