"""Data sets that ship with the repository (MNIST), read offline."""
