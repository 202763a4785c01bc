"""The wheel carries what an installed user needs: configs loadable by name, type markers."""
import glob
import os
import subprocess
import sys
import zipfile

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def test_wheel_ships_configs_and_type_markers(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), ROOT], check=True, capture_output=True)
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {os.path.basename(n) for n in names if n.startswith("twinkle_metrics/configs/")}
    assert shipped == {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.json"))}
    assert {"twinkle_metrics/py.typed", "parallel/py.typed"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not any(n.startswith(("tests/", "launch/", "benchmarks/")) for n in names)

    # Installed (here: unpacked, run away from the checkout), configs load by name.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import twinkle_metrics.integrations.factory as f, sys; "
            "assert f.__file__.startswith(sys.argv[1]), f.__file__; "
            "cfg = f.load_config('megatron_demo', ['train.steps=3']); "
            "print(cfg['train']['steps'], f.build_metrics(cfg['metrics']).__class__.__name__)")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "MetricCollection"]
