"""Opening a model folder, below the loader, in three steps:

    locate.py     recognise a folder (or a Hub name, hub.py) from its config.json: a ModelFolder
    formats.py    the registry of folder formats (FOLDERS): each one's model config and weights
    integrity.py  a meshlm checkpoint's files checked against its manifest, and read back

meshlm.loading.open_model builds the model over them; meshlm.checkpoint writes what integrity.py
reads. Nothing here imports either. The modules are imported by name (meshlm.folders.locate, …):
this file imports none of them, so reading a manifest does not load the format registry.
"""
