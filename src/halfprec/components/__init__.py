"""What a run is built from: models/, data/ and tasks/ (each a registry, filled by importing every
module of its package), init schemes (init.py), and torchvision's transforms (vision.py)."""
