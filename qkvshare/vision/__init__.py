"""`qkvshare vision`: the paper's vision experiments (section 4.2) on `QKVShareForImageClassification`.

- `data`: scikit-learn's digits (default, offline), Hugging Face image datasets, image folders.
- `sets`: the set anomaly task (frozen features, one logit per item, permutation-equivariant without "+").
- `run`: the resumable variants x seeds command (`qkvshare vision`); `plots`: its figures.
"""
