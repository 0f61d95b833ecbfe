"""Skills in the Agent Skills format: built-in folders and a tenant's own.

See :mod:`holdfast_shared.skills.format` for the format and its checks,
``holdfast_gateway.skillupload`` for reading an uploaded zip safely (only the
gateway takes uploads),
:mod:`~holdfast_shared.skills.builtin` for the skills shipped with the
engine and :mod:`~holdfast_shared.skills.store` for a tenant's, and
:mod:`~holdfast_shared.skills.disclosure` for what the model is told of them.
"""

from holdfast_shared.skills.builtin import builtin_skills
from holdfast_shared.skills.disclosure import MOUNT_DIR, mount_path, skills_section, subcall_system
from holdfast_shared.skills.format import (
    MAX_DESCRIPTION_CHARS,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_NAME_CHARS,
    MAX_TOTAL_BYTES,
    NAME_PATTERN,
    SKILL_FILE,
    Skill,
    SkillInvalid,
    SkillTooLarge,
    check_name,
    new_skill,
    parse_skill_file,
    skill_from_folder,
)
from holdfast_shared.skills.store import (
    SkillSummary,
    create_skill,
    delete_skill,
    find_skill,
    find_summary,
    load_skills,
    skill_body,
    summaries,
    tenant_skills,
    unknown_skills,
)

__all__ = [
    "MAX_DESCRIPTION_CHARS",
    "MAX_FILES",
    "MAX_FILE_BYTES",
    "MAX_NAME_CHARS",
    "MAX_TOTAL_BYTES",
    "MOUNT_DIR",
    "NAME_PATTERN",
    "SKILL_FILE",
    "Skill",
    "SkillInvalid",
    "SkillSummary",
    "SkillTooLarge",
    "builtin_skills",
    "check_name",
    "create_skill",
    "delete_skill",
    "find_skill",
    "find_summary",
    "load_skills",
    "mount_path",
    "new_skill",
    "parse_skill_file",
    "skill_body",
    "skill_from_folder",
    "skills_section",
    "subcall_system",
    "summaries",
    "tenant_skills",
    "unknown_skills",
]
