"""A factory for the `python -m rannc.plan` test: returns (model, args, kwargs)."""
import zoo  # found because the CLI puts this script's folder on sys.path

if __name__ == "__main__":
    raise SystemExit("the CLI must not run this script's main block")


def make():
    return zoo.make("gpt", batch=4)
