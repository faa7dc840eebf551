"""``python -m fastdp.info``: print what fastdp was built with and which path each stage takes."""

from fastdp._info import format_info, info

if __name__ == "__main__":
    print(format_info(info()))
