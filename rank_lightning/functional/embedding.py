"""Accuracy of low-dimensional embeddings: PCA plus a linear max-margin classifier (Sanyal et al. Sec. 3.5, 4.4)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor

from rank_lightning.validation import check_non_negative_int, check_positive, check_positive_int

__all__ = ["low_dimensional_accuracy"]


def _as_numpy(x: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().double().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def low_dimensional_accuracy(
    train_features: Tensor | np.ndarray,
    train_labels: Tensor | np.ndarray,
    test_features: Tensor | np.ndarray,
    test_labels: Tensor | np.ndarray,
    dims: Sequence[int],
    *,
    c: float = 1.0,
    max_iter: int = 1000,
    random_state: int = 0,
) -> dict[int, float]:
    """Test accuracy of a linear max-margin classifier on PCA embeddings of each dimension in ``dims``.

    Sanyal et al. Sec. 3.5 and 4.4 (Tables 3-4): PCA is fitted on the training embeddings (centred, as PCA is) and
    projects both sets to ``m'`` dimensions; the projections are standardised to zero mean and unit variance with the
    training statistics; a linear max-margin classifier with an l2 penalty (scikit-learn's ``LinearSVC``, one-vs-rest)
    is trained on them and scored on the test set. The paper trained a hinge-loss classifier with SGD for 1000
    iterations; ``LinearSVC`` here minimises the squared hinge loss in the primal, which converges reliably in a few
    milliseconds where the plain hinge loss often stops at the iteration limit.

    Args:
        train_features: (N, d) training embeddings.
        train_labels: (N,) integer labels.
        test_features: (N', d) test embeddings.
        test_labels: (N',) integer labels.
        dims: embedding dimensions ``m'``, each in ``[1, min(N, d)]``.
        c: inverse l2 regularisation strength of the classifier.
        max_iter: iteration limit of the classifier's solver.
        random_state: seed of the solver.

    Returns:
        ``{m': accuracy}`` with accuracies in ``[0, 1]``, in the order of ``dims``.

    Raises:
        ValueError: on mismatched shapes or a dimension outside ``[1, min(N, d)]``.
    """
    # Imported here: scikit-learn takes about a second to import and only this function needs it.
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import LinearSVC

    check_positive("c", c)
    check_positive_int("max_iter", max_iter)
    check_non_negative_int("random_state", random_state)  # scikit-learn's seeds: 0 to 2**32 - 1
    x_train, y_train = _as_numpy(train_features), _as_numpy(train_labels)
    x_test, y_test = _as_numpy(test_features), _as_numpy(test_labels)
    if x_train.ndim != 2 or x_test.ndim != 2 or x_train.shape[1] != x_test.shape[1]:
        raise ValueError(
            f"features must be 2-D with the same width, got shapes {x_train.shape} and {x_test.shape}; "
            "reduce activations first with rank_lightning.functional.reduce_activations"
        )
    if len(y_train) != len(x_train) or len(y_test) != len(x_test):
        raise ValueError(
            f"labels must have one entry per sample, got {len(y_train)} for {len(x_train)} training samples and "
            f"{len(y_test)} for {len(x_test)} test samples"
        )
    max_dim = min(x_train.shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= max_dim:
            raise ValueError(f"each dimension must be an integer in [1, min(N, d)] = [1, {max_dim}], got {dim!r}")
    # One PCA with the largest dimension serves every smaller one: its leading components are the same.
    pca = PCA(n_components=max(dims), svd_solver="full").fit(x_train)
    z_train, z_test = pca.transform(x_train), pca.transform(x_test)
    accuracies: dict[int, float] = {}
    for dim in dims:
        scaler = StandardScaler().fit(z_train[:, :dim])
        classifier = LinearSVC(C=c, dual=False, max_iter=max_iter, random_state=random_state)
        classifier.fit(scaler.transform(z_train[:, :dim]), y_train)
        accuracies[dim] = float(classifier.score(scaler.transform(z_test[:, :dim]), y_test))
    return accuracies
