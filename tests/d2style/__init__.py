"""A miniature of a detectron2-style codebase whose ``utils/comm.py`` is distcomm."""
