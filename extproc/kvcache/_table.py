"""Block hash -> bitmask of the pods holding it: the shared core of both prefix indexes.

One int per block instead of one set per block keeps memory low, and a longest-prefix
lookup is a single pass of `&` over the request's blocks that stops as soon as no pod
still matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["PodBitmaskTable"]


class PodBitmaskTable:
    """Maps block hash -> int bitmask; each pod owns one bit (slots reused after release)."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self._bit_of: dict[str, int] = {}  # pod -> its bit value (1 << slot)
        self._pod_of_slot: list[str | None] = []
        self._free_slots: list[int] = []

    def bit(self, pod: str) -> int:
        """The pod's bit, allocating a slot on first use."""
        bit = self._bit_of.get(pod)
        if bit is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._pod_of_slot[slot] = pod
            else:
                slot = len(self._pod_of_slot)
                self._pod_of_slot.append(pod)
            bit = 1 << slot
            self._bit_of[pod] = bit
        return bit

    def existing_bit(self, pod: str) -> int:
        """The pod's bit, or 0 when it has none."""
        return self._bit_of.get(pod, 0)

    def release(self, pod: str) -> None:
        """Free the pod's slot. Its blocks must already be cleared (see `discard`)."""
        bit = self._bit_of.pop(pod, 0)
        if bit:
            slot = bit.bit_length() - 1
            self._pod_of_slot[slot] = None
            self._free_slots.append(slot)

    def pods(self) -> list[str]:
        return list(self._bit_of)

    def add(self, bit: int, block: int) -> bool:
        """Mark `block` as held by the pod with `bit`; True when it was not held before."""
        masks = self.masks
        old = masks.get(block, 0)
        if old & bit:
            return False
        masks[block] = old | bit
        return True

    def discard(self, bit: int, block: int) -> bool:
        """Unmark; True when the pod held the block."""
        masks = self.masks
        old = masks.get(block, 0)
        if not old & bit:
            return False
        new = old & ~bit
        if new:
            masks[block] = new
        else:
            del masks[block]
        return True

    def mask_of(self, pods: Iterable[str]) -> int:
        bit_of = self._bit_of
        mask = 0
        for pod in pods:
            mask |= bit_of.get(pod, 0)
        return mask

    def longest_prefix(self, blocks: Sequence[int], restrict: int = -1) -> dict[str, int]:
        """Pod -> number of leading `blocks` it holds (pods with 0 are left out).

        One pass: `active` is the set of pods matching every block so far; pods leave it
        at the block they miss, and the loop ends when it is empty. `restrict` is a
        bitmask of the pods of interest (all by default).
        """
        result: dict[str, int] = {}
        masks = self.masks
        active = restrict
        matched = 0
        for block in blocks:
            still = active & masks.get(block, 0)
            if still != active:
                if matched:
                    self._record(active & ~still, matched, result)
                if not still:
                    return result
                active = still
            matched += 1
        if matched and active:
            self._record(active, matched, result)
        return result

    def _record(self, mask: int, matched: int, result: dict[str, int]) -> None:
        names = self._pod_of_slot
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            mask ^= low
            # restrict=-1 has bits for slots never allocated; only real pods are reported.
            if slot < len(names):
                name = names[slot]
                if name is not None:
                    result[name] = matched
            else:
                return
