"""The scaler: torch's GradScaler state machine over the step engine, and its options."""

from __future__ import annotations
