"""Serving a trained model beside training: ``tensorfleet serve-model`` (``server.py``).

``tables.py`` keeps a table's rows for lookups, ``model.py`` applies checkpoint files to the module
atomically while predictions run, ``reload.py`` follows the checkpoint directory, ``server.py`` is
the HTTP app and the command.
"""
