"""What a run trains on: DATASET resolved and read in each rank (`dataset`), chat conversations and
preference pairs tokenised with the checkpoint's chat template (`chat`, `preference`), and what stage
`data` writes: the embedded default's files (`data_files`), a user's file split into train and held-out
(`user_data`) and Hub datasets staged once into the checkpoints root (`staged`). The corpus those
files are cut from stays with the embedded checkpoints it pretrains (checkpoint/corpus.py)."""
