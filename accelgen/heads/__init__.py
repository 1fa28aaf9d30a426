"""Trained heads: the small modules some methods draft or exit with (EAGLE's head, Medusa's heads, PaSS's
look-ahead embeddings, exit adapters and classifiers), one file per kind, with their files on disk (io.py).

The drafters and exits load them; `train/` trains and saves them. Nothing here imports either."""
