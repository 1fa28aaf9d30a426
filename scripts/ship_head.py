"""Make a trained EAGLE head the one the package ships for an embedded model (accelgen/heads/shipping.py): its
weights in bfloat16, its config, learning curve and held-out evaluation copied into accelgen/heads/shipped/.

    python scripts/ship_head.py OUT --model smollm2-135m
"""

from __future__ import annotations

import argparse

from accelgen.heads.shipping import ship


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", help="The --out folder of `accelgen train eagle`.")
    parser.add_argument("--model", default="smollm2-135m", help="The embedded model it was trained for.")
    args = parser.parse_args()
    folder = ship(args.trained, args.model)
    print(f"shipped: {folder}")


if __name__ == "__main__":
    main()
