# From pytorch/examples, distributed/ddp-tutorial-series/datautils.py (commit 77f55b9), BSD 3-Clause License,
# Copyright (c) 2017, PyTorch contributors: https://github.com/pytorch/examples/blob/main/LICENSE
# ruff: noqa: W292, W293, I001
import torch
from torch.utils.data import Dataset

class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size
    
    def __getitem__(self, index):
        return self.data[index]