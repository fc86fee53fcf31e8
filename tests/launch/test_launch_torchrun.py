"""pipeline/launch/torchrun.py: the one-node launch command needs no shell to expand it."""

from helpers import run_pipeline


def test_single_node_log_dir_has_no_shell_variables(tmp_path):
    """`train` runs torchrun without a shell on one node: nothing in its command may need expanding."""
    result = run_pipeline("train", "--model", "Qwen/Qwen3-4B-Instruct-2507", "--path", "native", "--target", "trn2",
                          "--dry-run", root=tmp_path)
    command = result.stdout.split("launch command:")[1]
    assert "${" not in command and "--log-dir=" in command and "/runs/native/logs " in command
