"""FlashRecovery: restart only the failed rank, in place; its state comes from a live data-parallel replica."""
