// fmt's out-of-line code, compiled once for the whole build (the target flashcpp_fmt,
// CMakeLists.txt). With FMT_HEADER_ONLY every source that formats compiled all of it again at
// -O3: 5-9 s a source, over a dozen sources (README "Two commands"). Without it, fmt's headers
// declare these functions and the sources call them here.
//
// Written for fmt 9 (the version CMakeLists.txt checks before it takes this path; another
// version builds header-only as before). format-inl.h defines each FMT_FUNC function; those are
// not inline in this mode, so they are emitted here. The templates that it defines and
// that fmt's headers only declare are instantiated below for the character type we format (char).
#ifdef FMT_HEADER_ONLY
#error "cmake/fmt_compiled.cc is the compiled half of fmt; build it without FMT_HEADER_ONLY"
#endif
#include <fmt/format.h>
#include <fmt/format-inl.h>

#include <locale>

FMT_BEGIN_NAMESPACE
namespace detail {

// Shortest round-trip digits of a float or double (format.h's float writer).
template FMT_API auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template FMT_API auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;

// The locale hooks of "{:L}" and of vformat_to with a locale.
template FMT_API locale_ref::locale_ref(const std::locale& loc);
template FMT_API auto locale_ref::get<std::locale>() const -> std::locale;
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;

}  // namespace detail
FMT_END_NAMESPACE
