"""Data, in one package: training arrays and loaders (:mod:`.loaders`, re-exported here), the real
datasets that installed packages ship (:mod:`.datasets`), image/audio preprocessing for calibration
(:mod:`.preprocess`) and the pure-Python image decoder it falls back on (:mod:`.image_decoder`)."""

from .loaders import (
    DataLoader,
    Dataset,
    as_loader,
    check_inputs,
    check_labels,
    from_arrays,
    load_npz,
    open_arrays,
    read_arrays,
    save_npz,
)

__all__ = ["DataLoader", "Dataset", "as_loader", "check_inputs", "check_labels", "from_arrays", "load_npz",
           "open_arrays", "read_arrays", "save_npz"]
