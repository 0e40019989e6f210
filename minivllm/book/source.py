"""The C++ the book teaches, shown from the files the compiler reads (minivllm/kernels/csrc): a region of a file,
rendered as highlighted C++ in the book and as plain text where nbval compares it."""

from minivllm.kernels.build import source_region


class CppRegion:
    def __init__(self, file: str, region: str):
        self.file, self.region, self.code = file, region, source_region(file, region)

    def __repr__(self) -> str:
        return self.code

    def _repr_markdown_(self) -> str:
        return f"`minivllm/kernels/csrc/{self.file}`, region `{self.region}`:\n\n```cpp\n{self.code}\n```"


def show_cpp(file: str, region: str) -> CppRegion:
    """Region `region` of minivllm/kernels/csrc/`file`, for a cell to display."""
    return CppRegion(file, region)
