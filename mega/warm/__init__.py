"""Warm processes: a per-node zygote that has imported torch, megatron-core and mega once and
forks every torchrun agent and rank of every attempt (``zygote``), and the tiny client that
torchrun starts in a rank's place (``client``). Nothing here imports torch at package import."""
