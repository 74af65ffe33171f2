"""The vktrain delegate blob's fixed header: its byte layout, parsing and bounds checks (the rest of
the format, and why it is laid out so, is described in vktrain/serialization/blob.py).

Byte layout (all integers little-endian; every region starts at a multiple of 16 bytes):

    offset  size  field
    0       4     magic              b"VKTB"
    4       4     header_size        uint32, 56 with the CHECKSUMS flag, else 48
    8       4     format_version     uint32, 1, or 2 when the graph holds synthetic constants
    12      4     flags              uint32, bit 0 CHECKSUMS (every blob this vktrain writes), bit 1 NAMED_DATA
                                       (constants in the .pte's named data); no other bits
    16      8     flatbuffer_offset  uint64, >= header_size, multiple of 16
    24      8     flatbuffer_size    uint64, bytes of the flatbuffer (schema.fbs, identifier "VKT1")
    32      8     segment_offset     uint64, >= flatbuffer end, multiple of 16
    40      8     segment_size       uint64, bytes of the segment area (a multiple of 16)
    48      4     graph_crc32        uint32, CHECKSUMS only: CRC-32 of bytes [0, 48) and of the flatbuffer
    52      4     (zero)
    then zero padding, the flatbuffer, zero padding, the segment area.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Optional

from vktrain.errors import VktrainError


ALIGNMENT = 16
FLATBUFFER_IDENTIFIER = b"VKT1"


class BlobFormatError(VktrainError, ValueError):
    """The bytes are not a valid vktrain delegate blob; the message names the bad field."""


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class BlobHeader:
    flatbuffer_offset: int
    flatbuffer_size: int
    segment_offset: int
    segment_size: int
    format_version: int = 1
    graph_crc32: Optional[int] = None  # None: a blob without the CHECKSUMS flag (written before it existed)
    named_data: bool = False  # the NAMED_DATA flag: some constants live in the .pte's named data

    MAGIC: ClassVar[bytes] = b"VKTB"
    FORMAT_VERSION: ClassVar[int] = 2  # the newest version this vktrain reads and writes
    PLAIN_VERSION: ClassVar[int] = 1  # blobs without synthetic constants
    SYNTHETIC_VERSION: ClassVar[int] = 2  # blobs with at least one synthetic constant
    FLAG_CHECKSUMS: ClassVar[int] = 1
    FLAG_NAMED_DATA: ClassVar[int] = 2
    STRUCT: ClassVar[struct.Struct] = struct.Struct("<4sIIIQQQQ")
    SIZE: ClassVar[int] = STRUCT.size  # 48: the fields graph_crc32 covers
    CHECKSUM_STRUCT: ClassVar[struct.Struct] = struct.Struct("<I4x")
    CHECKSUMMED_SIZE: ClassVar[int] = SIZE + CHECKSUM_STRUCT.size  # 56

    @property
    def size(self) -> int:
        return self.SIZE if self.graph_crc32 is None else self.CHECKSUMMED_SIZE

    def fields_bytes(self) -> bytes:
        """Bytes [0, 48): the header fields, which graph_crc32 covers together with the flatbuffer."""
        flags = (0 if self.graph_crc32 is None else self.FLAG_CHECKSUMS) | (self.FLAG_NAMED_DATA if self.named_data else 0)
        return self.STRUCT.pack(self.MAGIC, self.size, self.format_version, flags, self.flatbuffer_offset,
                                self.flatbuffer_size, self.segment_offset, self.segment_size)

    def to_bytes(self) -> bytes:
        if self.graph_crc32 is None:
            return self.fields_bytes()
        return self.fields_bytes() + self.CHECKSUM_STRUCT.pack(self.graph_crc32)

    @classmethod
    def parse(cls, data: memoryview) -> "BlobHeader":
        """Read and bounds-check the header of a blob of len(data) bytes."""
        total = len(data)
        if total < cls.SIZE:
            raise BlobFormatError(f"blob is {total} bytes, shorter than the {cls.SIZE}-byte header (truncated?)")
        magic, header_size, version, flags, fb_offset, fb_size, seg_offset, seg_size = cls.STRUCT.unpack_from(data, 0)
        if magic != cls.MAGIC:
            raise BlobFormatError(f"blob magic is {bytes(magic)!r}, expected {cls.MAGIC!r} "
                                  "(not a vktrain delegate blob)")
        if not 1 <= version <= cls.FORMAT_VERSION:
            raise BlobFormatError(f"blob format version is {version}; this vktrain reads versions 1 to "
                                  f"{cls.FORMAT_VERSION} (blob from a newer vktrain?)")
        if flags & ~(cls.FLAG_CHECKSUMS | cls.FLAG_NAMED_DATA):
            raise BlobFormatError(f"header flags are {flags:#x}; the flags defined are CHECKSUMS "
                                  f"({cls.FLAG_CHECKSUMS:#x}) and NAMED_DATA ({cls.FLAG_NAMED_DATA:#x}) "
                                  f"(blob from a newer vktrain?)")
        checksummed = bool(flags & cls.FLAG_CHECKSUMS)
        expected_size = cls.CHECKSUMMED_SIZE if checksummed else cls.SIZE
        if header_size != expected_size:
            raise BlobFormatError(f"header_size field is {header_size}, expected {expected_size} with header flags "
                                  f"{flags:#x}")
        if total < header_size:
            raise BlobFormatError(f"blob is {total} bytes, shorter than its {header_size}-byte header (truncated?)")
        graph_crc32 = cls.CHECKSUM_STRUCT.unpack_from(data, cls.SIZE)[0] if checksummed else None
        if fb_offset < header_size or fb_offset % ALIGNMENT:
            raise BlobFormatError(f"flatbuffer_offset {fb_offset} must be >= the header size {header_size} and a "
                                  f"multiple of {ALIGNMENT}")
        if fb_size < 8:  # root offset + file identifier
            raise BlobFormatError(f"flatbuffer_size {fb_size} is too small for a flatbuffer (>= 8 bytes)")
        if fb_offset + fb_size > total:
            raise BlobFormatError(f"flatbuffer [{fb_offset}, {fb_offset + fb_size}) extends past the end of the "
                                  f"{total}-byte blob (truncated?)")
        if seg_offset < fb_offset + fb_size or seg_offset % ALIGNMENT:
            raise BlobFormatError(f"segment_offset {seg_offset} must be >= the flatbuffer end {fb_offset + fb_size} "
                                  f"and a multiple of {ALIGNMENT}")
        if seg_offset + seg_size > total:
            raise BlobFormatError(f"segment area [{seg_offset}, {seg_offset + seg_size}) extends past the end of the "
                                  f"{total}-byte blob (truncated?)")
        return cls(fb_offset, fb_size, seg_offset, seg_size, version, graph_crc32, bool(flags & cls.FLAG_NAMED_DATA))
