"""Data loading for distributed runs: LoaderFactory, rank-cached data, exact evaluation."""

from nn_handler.data.exact import gather_in_dataset_order, weighted_mean
from nn_handler.data.factory import LoaderFactory
from nn_handler.data.loader import EpochDataLoader
from nn_handler.data.rank_cached import RankCachedDataset
from nn_handler.data.samplers import ExactEvalSampler, ShardBatchSampler, derive_seed

__all__ = [
    "EpochDataLoader",
    "ExactEvalSampler",
    "LoaderFactory",
    "RankCachedDataset",
    "ShardBatchSampler",
    "derive_seed",
    "gather_in_dataset_order",
    "weighted_mean",
]
