"""Data sets, read offline: MNIST (ships with the repository), MovieLens-100K (read from the recbole wheel
that `tensorfleet data fetch movielens` puts in the cache), synthetic click-through batches (made on the fly)."""
