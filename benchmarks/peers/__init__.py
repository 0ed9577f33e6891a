"""The engines batchrun is compared with, each in a virtualenv of its own under the batchrun cache."""
